raise ImportError("No module named 'hip_python_nonexistent'")
