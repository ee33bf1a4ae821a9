// Code outside any file mapping, for the unwinding tests: a spin loop copied into
// anonymous executable memory (as a JIT would) and called from main for argv[1]
// seconds. The unwinder cannot find a table there: its stacks must stop cleanly (a
// marker frame, counted), never crash or loop.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 10;
	/* mov $20000000, %ecx; 1: dec %ecx; jnz 1b; ret */
	static const unsigned char code[] = {0xb9, 0x00, 0x2d, 0x31, 0x01, 0xff, 0xc9, 0x75, 0xfc, 0xc3};
	void *mem = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	memcpy(mem, code, sizeof(code));
	void (*spin)(void) = (void (*)(void))mem;
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	printf("ready %d\n", getpid());
	fflush(stdout);
	do {
		spin();
		clock_gettime(CLOCK_MONOTONIC, &t);
	} while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
	return 0;
}
