// CPU-bound workload with a known call chain: main -> outer -> middle -> hot_leaf.
// One thread per online CPU (main's thread included), for argv[1] seconds.
// Built with clang -O2 -fno-omit-frame-pointer -mno-omit-leaf-frame-pointer.
#include <pthread.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long sink;
static unsigned long iterations[256];
static double deadline;

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) unsigned long hot_leaf(unsigned long x)
{
	for (int i = 0; i < 200000; i++) {
		x = x * 6364136223846793005UL + 1442695040888963407UL;
		__asm__ volatile("" : "+r"(x));
	}
	return x;
}

__attribute__((noinline)) unsigned long middle(unsigned long x)
{
	unsigned long r = hot_leaf(x);
	__asm__ volatile("" : "+r"(r));
	return r + 1;
}

__attribute__((noinline)) unsigned long outer(unsigned long x, long slot)
{
	while (now() < deadline) {
		x = middle(x);
		iterations[slot]++;
		__asm__ volatile("" : "+r"(x));
	}
	return x + 1;
}

static void *worker(void *arg)
{
	sink += outer((unsigned long)arg, (long)arg);
	return NULL;
}

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 10;
	long cpus = argc > 2 ? atol(argv[2]) : sysconf(_SC_NPROCESSORS_ONLN);
	pthread_t t[256];
	deadline = now() + seconds;
	if (cpus < 1)
		cpus = 1;
	if (cpus > 256)
		cpus = 256;
	for (long i = 1; i < cpus; i++)
		pthread_create(&t[i], NULL, worker, (void *)i);
	printf("ready %d\n", getpid());
	fflush(stdout);
	double t0 = now();
	sink += outer(0, 0);
	unsigned long total = iterations[0];
	for (long i = 1; i < cpus; i++) {
		pthread_join(t[i], NULL);
		total += iterations[i];
	}
	/* Throughput, for the benchmarks: calls of middle() per second, all threads. */
	printf("iterations_per_second %.1f\n", total / (now() - t0 + 1e-9));
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	printf("cpu_seconds %.3f\n", ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
					 ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6);
	return 0;
}
