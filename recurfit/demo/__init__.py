"""`recurfit demo`: the whole method on a real model, ending in a report (OUT/report.md).

1. Retrofit the parent (default: the embedded SmolLM2-135M) and check parity with its pruned self.
2. Prepare data: English prose (`embedded:prose`) and generated word problems (`embedded:math`), decontaminated.
3. Train the retrofit by the demo's recipe (recipe.yaml, also at recipes/demo.yaml): heal on prose, then an even
   mix of prose and math (the paper's two-phase training); 1-sqrt curriculum, Muon, truncated backprop.
4. Train the parent on the same tokens in the same order (the paper's non-recurrent baseline).
5. Evaluate: validation loss at each test recurrence; greedy accuracy on held-out word problems (an easy split and
   a hard one of more steps) at r = 1, 2, 4, 8 and for the parent; GSM8K on a fixed slice of the test set.
6. Write OUT/report.md: a conclusion in plain words, then the tables, figures, FLOPs and sample generations.

settings.py  DemoSettings (torch-free: the command line takes its defaults from it), the default shape, and the
             recipe filled in
run.py       run_demo: the stages, each an ordinary recurfit command's Python API, timed
dry_run.py   `demo --dry-run`: the shape, the memory plan and the training time on this machine
report.py    report.md from what the stages measured
"""
