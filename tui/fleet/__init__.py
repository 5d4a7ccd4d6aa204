"""The fleet screen: many engines in one table (`batchtop top --url A --url B ...`)."""
