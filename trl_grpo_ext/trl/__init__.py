"""The TRL execution path: `GRPOTrainer(trl.GRPOTrainer)`, its config, callbacks, mixins and recipe parts."""
