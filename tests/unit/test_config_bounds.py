"""Every duration and size a config may hold is bounded: a value the daemon could not run with
(an epoll timeout that overflows, a zero hook timeout) is refused by check-config and reload,
naming the key, instead of crashing the daemon later."""

from __future__ import annotations

import pytest

from oomguard.config.loading import load_config_text
from oomguard.model.errors import ConfigError

GUARD = '[[guard]]\ncgroup = "/a"\n'

# (table text, key named in the issue, words of the reason)
TOO_BIG_OR_SMALL = [
    ('[daemon]\nrescan_interval = "100000d"\n', "daemon.rescan_interval", "to 1d"),
    ('[daemon]\npoll_interval = "2h"\n', "daemon.poll_interval", "to 1h"),
    ('[daemon]\npoll_interval = "0"\n', "daemon.poll_interval", "above 0"),
    ('[daemon]\nstore_max_age = "100000d"\n', "daemon.store_max_age", "to 3650d"),
    ('[daemon]\nstore_max_size = "2P"\n', "daemon.store_max_size", "to 1024.0TiB"),
    ('[hooks]\ntimeout = "0"\n', "hooks.timeout", "above 0"),
    ('[hooks]\ntimeout = "30d"\n', "hooks.timeout", "to 1d"),
    ('[criu]\ntimeout = "0"\n', "criu.timeout", "above 0"),
    ('[criu]\ntimeout = "1000d"\n', "criu.timeout", "to 1d"),
    ('[criu]\ncgroup_limit = "1M"\n', "criu.cgroup_limit", "from 32.0MiB"),
    ('[criu]\nghost_limit = "9P"\n', "criu.ghost_limit", "to 1024.0TiB"),
    ('[gpu]\npoll_interval = "100000d"\n', "gpu.poll_interval", "to 1d"),
    ('[gpu]\nhost_margin = "5P"\n', "gpu.host_margin", "to 1024.0TiB"),
    (GUARD + 'restore_quiet = "100000d"\n', "guard[0].restore_quiet", "to 1d"),
    (GUARD + 'post_action_delay = "2d"\n', "guard[0].post_action_delay", "to 1d"),
    (GUARD + 'freeze_deadline = "0"\n', "guard[0].freeze_deadline", "above 0"),
    (GUARD + 'freeze_deadline = "7d"\n', "guard[0].freeze_deadline", "to 1d"),
    (GUARD + 'kill_grace = "100000d"\n', "guard[0].kill_grace", "to 1d"),
    (GUARD + 'headroom = "3P"\n', "guard[0].headroom", "to 1024.0TiB"),
    (GUARD + 'restore_margin = "3P"\n', "guard[0].restore_margin", "to 1024.0TiB"),
    (GUARD + 'store_margin = "3P"\n', "guard[0].store_margin", "to 1024.0TiB"),
    (GUARD + 'actions = ["signal:SIGUSR1:100000d", "kill"]\n', "guard[0].actions", "at most 1d"),
    ('[[guard]]\nsystem = true\nmin_available = "3P"\n', "guard[0].min_available",
     "to 1024.0TiB"),
]


@pytest.mark.parametrize(("text", "key", "words"), TOO_BIG_OR_SMALL,
                         ids=[key for _, key, _ in TOO_BIG_OR_SMALL])
def test_out_of_bounds_value_is_refused_naming_the_key(text: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, "/etc/oomguard/x.toml")
    issues = caught.value.issues
    assert [issue.key for issue in issues] == [key]
    assert words in issues[0].reason
    assert issues[0].source == "/etc/oomguard/x.toml"


def test_values_at_the_bounds_are_accepted() -> None:
    config = load_config_text(
        '[daemon]\nrescan_interval = "1d"\npoll_interval = "1h"\nstore_max_age = "3650d"\n'
        'store_max_size = "1P"\n[hooks]\ntimeout = "1d"\n[criu]\ntimeout = "1d"\n'
        'cgroup_limit = "32M"\n' + GUARD + 'restore_quiet = "0"\npost_action_delay = "1d"\n'
        'kill_grace = "0"\nfreeze_deadline = "1ms"\n', "x.toml")
    assert config.rescan_interval == 86400.0 and config.poll_interval == 3600.0
    assert config.hook_timeout == 86400.0 and config.criu.cgroup_limit == 32 << 20
    assert config.store_max_size == 1 << 50
    guard = config.guards[0]
    assert guard.restore_quiet == 0 and guard.kill_grace == 0
    assert guard.freeze_deadline == 0.001
