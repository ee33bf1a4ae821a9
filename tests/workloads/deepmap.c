// A local user's attack on process discovery, for the shortlived tests: for argv[1]
// seconds, starts argv[2] children a second, each of which maps argv[5] files lying
// argv[3] directories deep (a path longer than any the sampler keeps) and as many argv[4]
// deep (kept, but absurdly deep), executable, burns ~50 ms and exits. Every new process
// maps the same files: a sampler that walked their paths each time would spend its time
// there instead of reading other users' new processes. The tree is built under argv[6].
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

// A directory `depth` levels below `base`, created as needed; its fd.
static int deep_dir(int base, int depth)
{
	int fd = dup(base);
	for (int i = 0; i < depth && fd >= 0; i++) {
		mkdirat(fd, "d", 0755);
		int next = openat(fd, "d", O_RDONLY | O_DIRECTORY);
		close(fd);
		fd = next;
	}
	return fd;
}

static void make_files(int dir, int n)
{
	static char page[4096];
	for (int i = 0; i < n; i++) {
		char name[16];
		snprintf(name, sizeof name, "f%02d", i);
		int fd = openat(dir, name, O_WRONLY | O_CREAT | O_TRUNC, 0755);
		if (fd >= 0) {
			if (write(fd, page, sizeof page) < 0)
				perror("write");
			close(fd);
		}
	}
}

static void map_files(int dir, int n)
{
	for (int i = 0; i < n; i++) {
		char name[16];
		snprintf(name, sizeof name, "f%02d", i);
		int fd = openat(dir, name, O_RDONLY);
		if (fd >= 0 && mmap(NULL, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0) == MAP_FAILED)
			perror("mmap");
		close(fd);
	}
}

int main(int argc, char **argv)
{
	if (argc < 7) {
		fprintf(stderr, "usage: deepmap SECONDS PER_SECOND LONG_DEPTH DEEP_DEPTH FILES DIR\n");
		return 2;
	}
	double seconds = atof(argv[1]), rate = atof(argv[2]);
	int long_depth = atoi(argv[3]), deep_depth = atoi(argv[4]), files = atoi(argv[5]);
	int base = open(argv[6], O_RDONLY | O_DIRECTORY);
	if (base < 0) {
		perror(argv[6]);
		return 2;
	}
	int far = deep_dir(base, long_depth);
	mkdirat(base, "e", 0755);
	int e = openat(base, "e", O_RDONLY | O_DIRECTORY);
	int deep = e >= 0 ? deep_dir(e, deep_depth) : -1;
	if (far < 0 || deep < 0) {
		perror("building the tree");
		return 2;
	}
	make_files(far, files);
	make_files(deep, files);
	signal(SIGCHLD, SIG_IGN);
	double start = now(), next = start;
	unsigned long started = 0;
	printf("ready %d\n", getpid());
	fflush(stdout);
	while (now() - start < seconds) {
		pid_t p = fork();
		if (p == 0) {
			map_files(far, files);
			map_files(deep, files);
			double until = now() + 0.05;
			while (now() < until)
				;
			_exit(0);
		}
		if (p > 0)
			started++;
		next += 1.0 / rate;
		double wait = next - now();
		if (wait > 0)
			usleep((useconds_t)(wait * 1e6));
	}
	printf("started %lu\n", started);
	return 0;
}
