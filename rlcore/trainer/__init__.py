"""The impure shell's pieces used by train.py: metric logging, plots, validation, run directories."""
