"""The task: answers and their parsing, rewards, data and prompts, and the data spec (`spec.DataSpec`: the options
that choose them, shared by both execution paths)."""
