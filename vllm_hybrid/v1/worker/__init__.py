"""Worker-side code of the overlay: replacements on vLLM's workers and model
runners, and the checks of pooled tensor views."""
