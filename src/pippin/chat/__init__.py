"""Chat layer: message normalisation and the model's chat template."""
