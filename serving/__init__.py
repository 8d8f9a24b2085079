"""WHERE the policy is enforced: Ray Serve deployments, the request router, the KV prefix cache.

This room is empty until the serving issue lands; see docs/architecture.md.
"""
