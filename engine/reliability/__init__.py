"""Long runs that check invariants: the soak, the soak through the server, the API under abuse."""
