// A native workload of a set depth for the Python-cost benchmark: DEPTH nested calls
// (no frame pointers in a plain `gcc -O2` build), the innermost spinning for argv[1]
// seconds. Prints "ready PID" once it spins.
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define DEPTH 20

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static volatile unsigned long sink;

__attribute__((noinline)) static unsigned long deep(int n, double end)
{
	unsigned long x = 0;
	if (n > 0) {
		x = deep(n - 1, end);
		sink += x;
		return x + 1;
	}
	printf("ready %d\n", getpid());
	fflush(stdout);
	while (now() < end)
		for (int i = 0; i < 100000; i++)
			x = x * 31 + i;
	return x;
}

int main(int argc, char **argv)
{
	double secs = argc > 1 ? atof(argv[1]) : 10;
	sink = deep(DEPTH, now() + secs);
	return 0;
}
