"""The cluster client: the one kubernetes ApiClient (kube) and the webhook's watches (watch)."""
