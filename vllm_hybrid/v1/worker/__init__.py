"""Worker classes of the overlay, selected through vLLM's ``worker_cls`` setting."""
