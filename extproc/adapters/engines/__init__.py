"""The engines' side: reading each engine's ``/metrics`` dialect, scraping it, finding a pool's members."""
