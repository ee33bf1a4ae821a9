// A root process with secrets in its memory, for the lying-tables test: key words on
// its stack, a password in a heap buffer whose address sits on its stack and, while it
// spins, in rbp. The secrets come from the file named by argv[1] (16 hex words, one a
// line), which it deletes; it prints "ready PID" and spins until killed.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static volatile uint64_t stop;

// rbp holds the password's address for as long as it spins.
__attribute__((noinline)) static void spin(char *pw)
{
	__asm__ volatile("push %%rbp\n\t"
			 "mov %0, %%rbp\n\t"
			 "1: pause\n\t"
			 "cmpq $0, %1\n\t"
			 "je 1b\n\t"
			 "pop %%rbp\n\t"
			 :
			 : "r"(pw), "m"(stop)
			 : "memory", "cc");
}

int main(int argc, char **argv)
{
	volatile uint64_t key[8];
	volatile char *volatile pws[4];
	uint64_t words[16];
	char *pw = malloc(4096);
	FILE *f;

	if (argc < 2 || !pw || !(f = fopen(argv[1], "r")))
		return 2;
	for (int i = 0; i < 16; i++)
		if (fscanf(f, "%lx", &words[i]) != 1)
			return 2;
	fclose(f);
	unlink(argv[1]);
	for (int i = 0; i < 8; i++) {
		key[i] = words[i];
		((uint64_t *)pw)[i] = words[8 + i];
	}
	for (int i = 0; i < 4; i++)
		pws[i] = pw + 8 * i;
	printf("ready %d\n", getpid());
	fflush(stdout);
	spin(pw);
	return key[0] == 0 && pws[0] == 0;
}
