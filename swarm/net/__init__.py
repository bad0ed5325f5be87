"""swarm.net"""
