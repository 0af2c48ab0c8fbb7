"""`batchjob bench --task image`: image rows through a vision-language model (image_rows.py), on a random-weight
Idefics3 written with its processor (vlm_export.py)."""
