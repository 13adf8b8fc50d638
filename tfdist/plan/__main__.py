"""`python -m tfdist.plan`: the same as `tfdist plan`."""
from tfdist.plan.cli import run

run()
