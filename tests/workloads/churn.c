// Process churn for the scale benchmarks: for argv[1] seconds, starts argv[2] processes
// per second, each exec'ing one of the executables argv[3..] in turn (round robin);
// each child burns CPU for ~20 ms and exits. An executable named "-" means no exec: the
// forked child spins ~0.2 ms and exits (the cheapest process there is). Reports
// started/failed counts.
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	if (argc < 4) {
		fprintf(stderr, "usage: churn SECONDS PER_SECOND EXECUTABLE...\n");
		return 2;
	}
	double seconds = atof(argv[1]), rate = atof(argv[2]);
	int nexe = argc - 3;
	signal(SIGCHLD, SIG_DFL);
	double start = now(), next = start;
	unsigned long started = 0, failed = 0;
	printf("ready %d\n", getpid());
	fflush(stdout);
	while (now() - start < seconds) {
		pid_t p = fork();
		if (p == 0) {
			char *exe = argv[3 + started % nexe];
			if (exe[0] == '-' && exe[1] == 0) {
				double until = now() + 0.0002;
				while (now() < until)
					;
				_exit(0);
			}
			execl(exe, exe, (char *)NULL);
			_exit(127);
		}
		if (p < 0)
			failed++;
		else
			started++;
		while (waitpid(-1, NULL, WNOHANG) > 0)
			;
		next += 1.0 / rate;
		double d = next - now();
		if (d > 0) {
			struct timespec ts = { (time_t)d, (long)((d - (time_t)d) * 1e9) };
			nanosleep(&ts, NULL);
		}
	}
	while (wait(NULL) > 0 || errno == EINTR)
		;
	printf("started %lu\nfailed %lu\n", started, failed);
	return 0;
}
