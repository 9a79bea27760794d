"""Fast, lean CPU runs: compute precision by hardware (`precision`), torch threads and their governor (`threads`),
the sampler's token draws (`token_draws`) and packed decode attention (`decode_attention`), and bf16 training
without weight copies held for backward (`autocast_weights`). No project imports: every layer may use it."""
