"""swarm.dht"""
