"""Surgery: a pretrained parent becomes a recurrent model.

- retrofit.py      retrofit(): the new model's config, and the weight transfer from the parent's kept layers
- selection.py     LayerSelection: which layers each part keeps (paper rule, explicit, ShortGPT, angular), shape checks
- layer_scores.py  angular distance and Block Influence per layer, Kneedle knees, the layer-scores figure
- calibration.py   calibration text for the layer scores (a file, or the embedded prose)
- pruning.py       the baselines' smaller parents: highest-scoring layers only (prune_layers), untied embeddings
- parity.py        the check that a retrofit equals its parent without the dropped layers
- raven.py         import of the paper authors' released checkpoints (huginn_raven format)

Nothing is imported here (`recurfit.retrofit` and `recurfit.LayerSelection` are the public names), so
`recurfit --help` stays torch-free. Loading a saved model is `recurfit.model.loading`'s job, not surgery's.
"""
