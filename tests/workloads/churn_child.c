// A short-lived process for the churn benchmark: ~20 ms of CPU in a named function
// (CHURN_MS in the environment sets another length).
#include <stdlib.h>
#include <time.h>

static volatile unsigned long sink;

__attribute__((noinline)) void churn_child_work(long ns)
{
	struct timespec t0, t;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
	do {
		for (int i = 0; i < 10000; i++)
			sink = sink * 6364136223846793005UL + 1;
		clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	} while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < ns);
}

int main(void)
{
	const char *ms = getenv("CHURN_MS");
	long n = ms ? atol(ms) : 20;
	churn_child_work((n > 0 && n < 10000 ? n : 20) * 1000000L);
	return 0;
}
