"""The GRPO core both execution paths share: the spec, the loss table and losses, advantages and the
degenerate-group rule, reward aggregation, dynamic sampling and the curriculum."""
