// Many mostly-idle processes for the scale benchmark: forks argv[1] children that each
// wake about every two seconds, spin ~0.2 ms and sleep again (1,000 of them: ~0.1 CPU), until argv[2] seconds pass.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static volatile unsigned long sink;

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) static void idler_spin(void)
{
	double until = now() + 0.0002;
	while (now() < until)
		sink++;
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: idlers COUNT SECONDS\n");
		return 2;
	}
	int n = atoi(argv[1]);
	double end = now() + atof(argv[2]);
	for (int i = 0; i < n; i++) {
		pid_t p = fork();
		if (p == 0) {
			srand(getpid());
			while (now() < end) {
				struct timespec ts = { 1, 500000000L + rand() % 1000000000L };
				if (ts.tv_nsec >= 1000000000L) {
					ts.tv_sec += 1;
					ts.tv_nsec -= 1000000000L;
				}
				nanosleep(&ts, NULL);
				idler_spin();
			}
			_exit(0);
		}
		if (p < 0) {
			perror("fork");
			break;
		}
	}
	printf("ready %d\n", getpid());
	fflush(stdout);
	while (wait(NULL) > 0)
		;
	return 0;
}
