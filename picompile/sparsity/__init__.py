"""The algorithms behind the sparsity passes: activation-profile statistics, calibration text, the predictors
(MLP and closed-form low-rank linear) and hot/cold neuron placement (the ILP)."""
