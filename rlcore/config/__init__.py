"""The checks beside the schema (configs.py): the pre-flight pass, the compatibility table, the model-kind
defaults, the memory fit, the models' config checks, the algorithm's table checks, and the flag reference.
Only this package and the shell (rlcore.trainer) import `configs`."""
