"""The TRL execution path: `GRPOTrainer(trl.GRPOTrainer)`, its config, callbacks, mixins and recipe parts, and TRL's
internals they use (`internals`: the code copied from TRL, TRL's private state)."""
