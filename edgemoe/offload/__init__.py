"""Expert offload: host banks, the device expert cache and its policies, offloaded experts, the miss copy."""
