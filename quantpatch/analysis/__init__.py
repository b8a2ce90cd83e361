"""Reading what training runs leave behind: saved tensors and training logs."""
