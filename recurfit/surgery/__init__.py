"""Surgery: a pretrained parent becomes a recurrent model.

- retrofit.py      retrofit(): layer selection (paper rule, explicit, ShortGPT, angular), weight transfer, the
                   parity check against the pruned parent, pruning and untying for the baselines, and
                   load_recurrent_model() (a saved model, or the embedded default retrofitted on the spot)
- layer_scores.py  angular distance and Block Influence per layer, Kneedle knees, the layer-scores figure
- raven.py         import of the paper authors' released checkpoints (huginn_raven format)

Nothing is imported here (`recurfit.retrofit` and `recurfit.LayerSelection` are the public names), so
`recurfit --help` stays torch-free.
"""
