"""Training: ``fit`` (the loop), ``train_step``, ``evaluate``, optimizer/schedule and checkpoints."""
