"""Foundation of swarm: identities, addresses, the event-loop bridge, serialization, errors."""
