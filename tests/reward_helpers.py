"""A row function for the math reward's timeout tests, in a module of its own: the spawned workers import it
by name, and this module imports nothing heavy (the test module would make each worker load torch)."""
import signal
import time


def sleepy_row(gold, pred):
    """"slow" sleeps (the worker's timer interrupts the sleep); "stuck" also ignores the timer, as a long C
    call would, so only the parent's deadline ends it; anything else compares as strings."""
    if pred == "stuck":
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(60)
    if pred == "slow":
        time.sleep(30)
    return gold == pred
