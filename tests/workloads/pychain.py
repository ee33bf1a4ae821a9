# A Python program for the Python-frame tests: a chain through a function, a class
# method and a generator to a busy leaf, a C extension called from Python, and a thread
# that spends its time in C with the GIL released. Line numbers are asserted by the
# tests: keep LEAF_LINE's statement where the marker says.
import hashlib
import os
import sys
import threading
import time

DATA = b"x" * (4 << 20)


def leaf(n):
    x = 0
    for i in range(n):
        x = (x * 31 + i) % 1000003  # LEAF_LINE
    return x


class K:
    def method(self, n):
        return leaf(n)


def gen(n):
    k = K()
    while True:
        yield k.method(n)


def outer(end):
    for _ in gen(2000):
        if time.time() > end:
            return


def hash_it():
    # sha256 of 4 MiB releases the GIL while it runs in C.
    return hashlib.sha256(DATA).digest()


def hashing(end):
    while time.time() < end:
        hash_it()


if __name__ == "__main__":
    end = time.time() + float(sys.argv[1])
    t = threading.Thread(target=hashing, args=(end,), name="hasher")
    t.start()
    print("ready", os.getpid(), flush=True)
    outer(end)
    t.join()
