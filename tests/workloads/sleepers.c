/* Threads that block and never wake by themselves, for the off-CPU test of a process
 * killed while all its threads wait: THREADS threads each block in `sleeper`, reading
 * a pipe no one writes. Usage: sleepers THREADS. Prints "ready" once all are started;
 * lives until killed. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int never[2];

__attribute__((noinline)) void sleeper(void)
{
	char c;
	if (read(never[0], &c, 1) != 1)
		abort();
}

static void *worker(void *arg)
{
	(void)arg;
	sleeper();
	return NULL;
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 100, i;
	pthread_t t;

	if (n < 1 || n > 4096 || pipe(never))
		return 2;
	for (i = 0; i < n; i++)
		if (pthread_create(&t, NULL, worker, NULL))
			return 1;
	printf("ready\n");
	fflush(stdout);
	for (;;)
		pause();
}
