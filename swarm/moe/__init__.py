"""swarm.moe"""
