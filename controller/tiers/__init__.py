"""evocache.controller.tiers"""
