"""A child for tests/test_zygote.py: ``main(action, *args)`` does what ``action`` says."""
import os
import sys
import time


def main(action: str, *args: str) -> int:
    if action == "echo":
        print(" ".join(args))
        print("to stderr", file=sys.stderr)
        return 0
    if action == "exit":
        return int(args[0])
    if action == "raise":
        raise ValueError("raised in the child")
    if action == "sleep":
        print("sleeping", flush=True)
        time.sleep(float(args[0]))
        return 0
    if action == "describe":  # what a fresh process would show
        import numpy as np

        print(os.getcwd(), os.environ.get("CHILD_VAR"), os.getppid(), np.random.randint(1 << 30))
        return 0
    raise SystemExit(f"unknown action {action}")
