/* Waits off CPU in three named functions, for the off-CPU tests: blocked on a pipe
 * (a helper thread writes after PIPE_MS), asleep (SLEEP_MS), and on a mutex the helper
 * holds for MUTEX_MS. Built with gcc -O2 (no frame pointers). Usage: offcpu SECONDS
 * [WARM_MS]: first asleep in warm_sleep for WARM_MS, not measured (a profiler's first
 * waits of a new binary may come before its unwind table). Prints "ready", then at the end what it measured itself, per function and for the
 * main thread in all: wall time minus the thread's CPU time, in ns. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define PIPE_MS 20
#define SLEEP_MS 30
#define MUTEX_MS 25

static int cmd[2], data[2], ack[2];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static long long now(clockid_t c)
{
	struct timespec t;
	clock_gettime(c, &t);
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void nap(int ms)
{
	struct timespec t = { ms / 1000, (ms % 1000) * 1000000L };
	nanosleep(&t, NULL);
}

static void *helper(void *arg)
{
	char c;
	(void)arg;
	while (read(cmd[0], &c, 1) == 1) {
		if (c == 'p') {
			nap(PIPE_MS);
			if (write(data[1], "x", 1) != 1)
				abort();
		} else if (c == 'm') {
			pthread_mutex_lock(&lock);
			if (write(ack[1], "x", 1) != 1)
				abort();
			nap(MUTEX_MS);
			pthread_mutex_unlock(&lock);
		} else {
			break;
		}
	}
	return NULL;
}

__attribute__((noinline)) void wait_pipe(void)
{
	char c;
	if (read(data[0], &c, 1) != 1)
		abort();
}

__attribute__((noinline)) void wait_sleep(void)
{
	nap(SLEEP_MS);
}

__attribute__((noinline)) void warm_sleep(void)
{
	nap(SLEEP_MS);
}

__attribute__((noinline)) void wait_mutex(void)
{
	pthread_mutex_lock(&lock);
	pthread_mutex_unlock(&lock);
}

/* Off-CPU time of the calling thread spent in `f`. */
static long long timed(void (*f)(void))
{
	long long w = now(CLOCK_MONOTONIC), c = now(CLOCK_THREAD_CPUTIME_ID);
	f();
	return (now(CLOCK_MONOTONIC) - w) - (now(CLOCK_THREAD_CPUTIME_ID) - c);
}

int main(int argc, char **argv)
{
	int secs = argc > 1 ? atoi(argv[1]) : 8;
	long long warm_end = now(CLOCK_MONOTONIC) + (argc > 2 ? atoll(argv[2]) : 0) * 1000000LL;
	long long pipe_ns = 0, sleep_ns = 0, mutex_ns = 0, end, w0, c0;
	pthread_t t;
	char c;

	/* The helper starts after the warm-up: its first wait, from its start, would
	 * otherwise last the whole warm-up and begin before a profiler knows the process. */
	while (now(CLOCK_MONOTONIC) < warm_end)
		warm_sleep();
	if (pipe(cmd) || pipe(data) || pipe(ack) || pthread_create(&t, NULL, helper, NULL))
		return 1;
	printf("ready\n");
	fflush(stdout);
	w0 = now(CLOCK_MONOTONIC);
	c0 = now(CLOCK_THREAD_CPUTIME_ID);
	end = w0 + secs * 1000000000LL;
	while (now(CLOCK_MONOTONIC) < end) {
		if (write(cmd[1], "p", 1) != 1)
			return 1;
		pipe_ns += timed(wait_pipe);
		if (write(cmd[1], "m", 1) != 1 || read(ack[0], &c, 1) != 1)
			return 1;
		mutex_ns += timed(wait_mutex);
		sleep_ns += timed(wait_sleep);
	}
	printf("off_cpu_ns total=%lld pipe=%lld mutex=%lld sleep=%lld\n",
	       (now(CLOCK_MONOTONIC) - w0) - (now(CLOCK_THREAD_CPUTIME_ID) - c0),
	       pipe_ns, mutex_ns, sleep_ns);
	fflush(stdout);
	if (write(cmd[1], "q", 1) != 1)
		return 1;
	pthread_join(t, NULL);
	return 0;
}
