"""The coordinator daemon: config, supervisor, schedulers, prefix-cache policy, client and control API."""
