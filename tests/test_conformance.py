"""The conformance kit against this repository's targets (``membackend_targets`` in pyproject.toml):
host, the VMM backend on every simulated profile, and the third-party example fixture."""

from membackend.testing.conformance import (  # noqa: F401 - re-exported so pytest collects them here
    test_a_page_gets_a_new_generation_when_it_gets_new_memory,
    test_a_released_reservation_cannot_be_used,
    test_budget_names_its_source,
    test_device_fence_waits_for_everything_recorded,
    test_fault_backs_every_touched_page_with_generations,
    test_free_and_release_wait_for_recorded_work,
    test_free_drops_pages_and_keeps_the_range,
    test_free_needs_whole_pages,
    test_out_of_memory_is_a_result_and_changes_nothing,
    test_random_verb_sequences_keep_the_ledger_equal_to_the_driver,
    test_ranges_outside_the_reservation_are_refused,
    test_release_returns_everything,
    test_reserve_gives_whole_pages_and_no_memory,
    test_reserve_rejects_a_device_not_served,
    test_reserve_rejects_a_size_that_is_not_positive,
    test_sanitize_mode_catches_use_after_release,
)
