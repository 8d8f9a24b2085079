"""evocache.controller.eviction"""
