/* A storm of short waits for the off-CPU tests: THREADS threads each sleep US µs in a
 * loop (in `nap_storm`) for SECONDS, some 100,000 switches a second in all, far more
 * than firn's sampler takes the stacks of. Built with gcc -O2. Usage:
 * napstorm SECONDS THREADS US. Prints "ready", then at the end what the threads
 * measured themselves: wall time minus CPU time summed over them, in ns, and the waits. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int secs = 10, us = 100;
static long long total_ns, total_waits;
static pthread_mutex_t sum = PTHREAD_MUTEX_INITIALIZER;

static long long now(clockid_t c)
{
	struct timespec t;
	clock_gettime(c, &t);
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

__attribute__((noinline)) long long nap_storm(long long end)
{
	struct timespec t = { 0, us * 1000L };
	long long n = 0;

	while (now(CLOCK_MONOTONIC) < end) {
		nanosleep(&t, NULL);
		n++;
	}
	return n;
}

static void *worker(void *arg)
{
	long long w0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID), n;

	(void)arg;
	n = nap_storm(w0 + secs * 1000000000LL);
	pthread_mutex_lock(&sum);
	total_ns += (now(CLOCK_MONOTONIC) - w0) - (now(CLOCK_THREAD_CPUTIME_ID) - c0);
	total_waits += n;
	pthread_mutex_unlock(&sum);
	return NULL;
}

int main(int argc, char **argv)
{
	int threads = 16, i;
	pthread_t t[256];

	if (argc > 1)
		secs = atoi(argv[1]);
	if (argc > 2)
		threads = atoi(argv[2]);
	if (argc > 3)
		us = atoi(argv[3]);
	if (threads < 1 || threads > 256)
		return 2;
	printf("ready\n");
	fflush(stdout);
	for (i = 0; i < threads; i++)
		if (pthread_create(&t[i], NULL, worker, NULL))
			return 1;
	for (i = 0; i < threads; i++)
		pthread_join(t[i], NULL);
	printf("off_cpu_ns total=%lld waits=%lld\n", total_ns, total_waits);
	fflush(stdout);
	return 0;
}
