"""Placeholder until the demo is written."""
def add_arguments(p):
    pass
def run_demo(args):
    return 0
