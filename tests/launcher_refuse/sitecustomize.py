"""Put first on PYTHONPATH by tests/test_rank_launcher.py: every interpreter started with it
runs one idle daemon thread, which a plain rank does not mind and the preloaded helper must
refuse to fork from."""
import threading
import time

threading.Thread(target=lambda: time.sleep(3600), daemon=True, name="idle-test-thread").start()
