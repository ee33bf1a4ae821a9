# A Python workload of a set depth for the Python-cost benchmark: 12 nested Python
# calls, the innermost spinning in pure Python for argv[1] seconds. Prints "ready PID".
import os
import sys
import time


def deep(n, end):
    if n:
        return deep(n - 1, end) + 1
    print("ready", os.getpid(), flush=True)
    x = 0
    while time.time() < end:
        for i in range(10000):
            x = (x * 31 + i) % 1000003
    return x


deep(12, time.time() + float(sys.argv[1]))
