// A short-lived process for the churn benchmark: ~20 ms of CPU in a named function.
#include <time.h>

static volatile unsigned long sink;

__attribute__((noinline)) void churn_child_work(void)
{
	struct timespec t0, t;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
	do {
		for (int i = 0; i < 10000; i++)
			sink = sink * 6364136223846793005UL + 1;
		clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	} while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < 20000000L);
}

int main(void)
{
	churn_child_work();
	return 0;
}
