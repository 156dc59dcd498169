"""The shell used by train.py: the command line, the config bound to the library's specs and plans, the
run built and looped, signals, checkpoints, run directories, metric logging, samples and plots."""
