"""The task: answers and their parsing, rewards, data and prompts."""
