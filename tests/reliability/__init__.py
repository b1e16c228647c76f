"""Reliability and security suite (issue 8): crashes, exits, forks, soak, bad input."""
