"""Drives Debian's headless Chromium (selenium + chromedriver) against a running firn
enricher's web view and checks what a person would see. Run by tests/tests/view.rs.

Checks: the page loads without console errors; the flame graph names the workload's
functions; choosing a process narrows every part of the page to it; search highlights
frames; the download link serves a pprof (saved for `go tool pprof`); with --offcpu-pid
(the sampler's --off-cpu), the off-CPU switch shows where that process waited, in the
off-CPU colour and the top table, and "both" shows it beside the on-CPU function, a
choice that survives a redraw and a reload; a window over the hour and an unknown mode
are refused with a message. Screenshots go to --shots.
"""
import argparse
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By


def browser():
    o = Options()
    o.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--window-size=1400,1100", f"--user-data-dir={tempfile.mkdtemp(prefix='firn-chromium-')}"):
        o.add_argument(a)
    o.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=o)


def wait(what, cond, timeout=30, show=None):
    """Waits for cond; on time out, says what `show` (or the last error) saw."""
    t0, last = time.time(), None
    while time.time() - t0 < timeout:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 (the page is redrawing)
            last = e
        time.sleep(0.2)
    seen = show() if show else last
    raise AssertionError(f"timed out waiting for {what}; saw {seen!r}")


def attrs(d, name):
    """The values of one attribute over the flame graph's frames, read in one script: the
    page redraws each round, so elements found in one call may be gone by the next."""
    return set(d.execute_script(
        "return Array.from(document.querySelectorAll('#flame-svg rect[' + arguments[0] + ']'),"
        " r => r.getAttribute(arguments[0]));", name))


def click(d, what, css):
    """Clicks the element css finds, finding it again if a redraw replaced it."""
    def go():
        d.find_element(By.CSS_SELECTOR, css).click()
        return True
    wait(what, go)


def names(d):
    return attrs(d, "data-name")


WAITS = ("wait_pipe", "wait_mutex", "wait_sleep")


def frames(d):
    """(name, off-CPU attribute, fill, width) of every frame of the flame graph, in one
    script."""
    return d.execute_script(
        "return Array.from(document.querySelectorAll('#flame-svg rect[data-name]'),"
        " r => [r.dataset.name, r.dataset.off || '', r.getAttribute('fill'), Number(r.getAttribute('width'))]);")


def widest(fr, name):
    """The widest frame of that name: where most of its time is."""
    return max((f for f in fr if f[0] == name), key=lambda f: f[3])


def nodes(d, name):
    """Every call tree node of that name: [path, weight, off-CPU part]."""
    return d.execute_script("""
        const v = window.__firnView(), out = [];
        const walk = (n, path) => {
            const p = path.concat([v.names[n[0]]]);
            if (v.names[n[0]] === arguments[0]) out.push([p.join(' > '), n[1], n[3]]);
            n[2].forEach((c) => walk(c, p));
        };
        walk(v.tree, []);
        return out;""", name)


def mode(d, m):
    """Switches the view to mode m and waits for the answer drawn in it."""
    click(d, f"the {m} switch", f'#mode button[data-mode="{m}"]')
    wait(f"the {m} view", lambda: d.execute_script(
        "const v = window.__firnView(); return v && v.mode === arguments[0] &&"
        " document.querySelector('#mode button[aria-pressed=true]').dataset.mode === arguments[0];", m))


def off_cpu(d, a, report):
    """The off-CPU switch: off, then both, then a redraw and a reload."""
    click(d, "reset", "#reset")
    wait("no filter", lambda: "pid=" not in d.current_url)
    assert d.execute_script("return window.__firnView().off_cpu;"), "the window measured no off-CPU time"
    mode(d, "off")
    assert "mode=off" in d.current_url, d.current_url
    wait("the waits in the off-CPU flame graph", lambda: all(w in names(d) for w in WAITS))
    title = d.find_element(By.ID, "chart-title").text
    assert "Off-CPU" in title, title
    assert "ms" in d.find_element(By.ID, "top-unit").text
    legend = d.find_element(By.ID, "legend").text
    assert "off-CPU" in legend, legend
    d.save_screenshot(f"{a.shots}/view-offcpu.png")
    # The waiting process alone: its waits lead the top table, in the off-CPU colour.
    click(d, "the waiting process", f'#processes tr[data-pid="{a.offcpu_pid}"]')
    listed = lambda: d.execute_script(  # noqa: E731
        "return Array.from(document.querySelectorAll('#processes tbody tr'), r => r.dataset.pid);")
    # Its pid alone: with --off-cpu, the forked child's wait before its exec (reading the
    # program in) is a process of the same pid running the test's program.
    wait("one process", lambda: set(listed()) == {a.offcpu_pid},
         show=lambda: (d.current_url, listed(), d.execute_script(
             "const v = window.__firnView(); return v && [v.mode, v.total, v.off_total];")))
    top = d.execute_script("return Array.from(document.querySelectorAll('#top tbody td.fn'), t => t.title);")
    assert all(w in top for w in WAITS), f"top functions off CPU: {top[:20]}"
    fr = [f for f in frames(d) if f[0] in WAITS]
    # The off-CPU colour: violet (hue 255–279), whatever ran the frame.
    assert fr and all(off == "1" and 255 <= int(f[4:f.index(",")]) < 280 for _, off, f, _ in fr), fr
    report["offcpu_top"] = top[:8]
    report["offcpu_share"] = d.execute_script(
        "const v = window.__firnView(); return [v.total, v.off_total, v.unit];")
    # Both: the on-CPU function and the waits side by side, each in its colour.
    click(d, "the pid filter", "#pid-filter")
    wait("no filter", lambda: "pid=" not in d.current_url)
    mode(d, "wall")
    wait("hot_leaf and the waits together", lambda: all(w in names(d) for w in WAITS + (a.function,)))
    # The waits are off CPU all but wholly, in its colour where most of their time is.
    # The busy leaf runs: a CPU-bound thread that waits for a CPU is runnable, not
    # waiting, and not counted off CPU (a little may be: its page faults, its exit).
    fr = frames(d)
    assert all(widest(fr, w)[1] == "1" for w in WAITS), f"a wait not coloured off-CPU: {nodes(d, WAITS[0])}"
    leaf = max(nodes(d, a.function), key=lambda n: n[1])
    assert leaf[2] < 0.2 * leaf[1], f"the busy leaf counted as waiting: {leaf}"
    assert widest(fr, a.function)[1] != "1", f"the busy leaf coloured off-CPU: {leaf}"
    report["wall_leaf_off_share"] = round(leaf[2] / leaf[1], 3)
    report["wall"] = d.execute_script(
        "const v = window.__firnView(); return [v.total, v.off_total, v.unit];")
    d.save_screenshot(f"{a.shots}/view-both.png")
    # A redraw (resize) and a reload keep the choice: it is in the URL's # part.
    d.execute_script("window.dispatchEvent(new Event('resize'));")
    d.refresh()
    wait("the reloaded page in both", lambda: d.execute_script(
        "const v = window.__firnView(); return v && v.mode === 'wall';"))
    assert "mode=wall" in d.current_url, d.current_url
    pressed = d.find_element(By.CSS_SELECTOR, "#mode button[aria-pressed=true]").get_attribute("data-mode")
    assert pressed == "wall", pressed
    wait("the waits after the reload", lambda: all(w in names(d) for w in WAITS + (a.function,)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--token", required=True, help="the enricher's HTTP token")
    ap.add_argument("--pid", required=True)
    ap.add_argument("--function", required=True, help="a function of the workload, e.g. hot_leaf")
    ap.add_argument("--shots", required=True)
    ap.add_argument("--pprof-out", required=True)
    ap.add_argument("--offcpu-pid", help="a process waiting off CPU (the sampler runs with --off-cpu)")
    a = ap.parse_args()
    d = browser()
    report = {}
    try:
        t0 = time.time()
        # Once with the token: the page sets its cookie and comes back without it.
        d.get(a.url + "/?token=" + a.token)
        assert "token=" not in d.current_url, d.current_url
        wait("the flame graph", lambda: a.function in names(d))
        report["first_draw_s"] = round(time.time() - t0, 2)
        # Frame kinds are coloured apart, with a legend naming them.
        kinds = attrs(d, "data-kind")
        report["frame_kinds"] = sorted(k for k in kinds if k)
        assert "0" in kinds, f"no native frame kind: {kinds}"
        legend = d.find_element(By.ID, "legend").text
        assert all(k in legend for k in ("native", "kernel", "Python")), legend
        d.save_screenshot(f"{a.shots}/view-machine.png")
        errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, f"console errors: {errors}"
        procs = d.find_elements(By.CSS_SELECTOR, "#processes tbody tr")
        report["processes_before"] = len(procs)
        assert len(procs) > 1, "the whole machine shows more than one process"

        # A click on the workload's process: every part narrows to it.
        click(d, "the workload's row", f'#processes tr[data-pid="{a.pid}"]')
        wait("the pid filter", lambda: d.find_element(By.ID, "pid-filter"))
        # Rows of that pid alone (a sample between its fork and its exec is a process of
        # the same pid running the parent's program).
        wait("one process", lambda: set(d.execute_script(
            "return Array.from(document.querySelectorAll('#processes tbody tr'), r => r.dataset.pid);")) == {a.pid})
        # One program under the flame graph's root: the workload's. A sample of the forked
        # child before its exec is of the same pid running the test's program (its thread
        # name), so a sliver under that second root is the truth, not a leak of the filter.
        roots = d.execute_script(
            "const v = window.__firnView(); return v.tree[2].map(n => [v.names[n[0]], n[1]]);")
        main_root = max(roots, key=lambda r: r[1])
        whole = sum(r[1] for r in roots)
        report["roots_after_filter"] = roots
        assert len(roots) <= 2 and main_root[1] >= 0.9 * whole, f"flame graph roots after the filter: {roots}"
        assert any(main_root[0] in p.split(" > ")[:2] for p, _, _ in nodes(d, a.function)), \
            f"{a.function} is not under the main root {main_root[0]}: {nodes(d, a.function)}"
        assert a.function in names(d)
        assert "pid=" + a.pid in d.current_url or f"pid={a.pid}" in d.current_url
        href = d.find_element(By.ID, "download").get_attribute("href")
        assert f"pid={a.pid}" in href, href
        d.save_screenshot(f"{a.shots}/view-process.png")

        # Search highlights.
        box = d.find_element(By.ID, "search")
        box.send_keys(a.function)
        wait("highlighted frames", lambda: d.find_elements(By.CSS_SELECTOR, "#flame-svg rect.match"))
        report["matches"] = d.execute_script("return document.querySelectorAll('#flame-svg rect.match').length;")
        info = d.find_element(By.ID, "flame-info").text
        assert "search matches" in info, info
        d.save_screenshot(f"{a.shots}/view-search.png")

        # Zoom into the highlighted frame and out again.
        click(d, "a highlighted frame", "#flame-svg rect.match")
        wait("zoomed", lambda: "zoomed" in d.find_element(By.ID, "flame-info").text)

        # The download link serves a pprof.
        auth = {"Authorization": "Bearer " + a.token}
        with urllib.request.urlopen(urllib.request.Request(href, headers=auth), timeout=30) as r:
            body = r.read()
        assert body[:2] == b"\x1f\x8b", "not gzip"
        open(a.pprof_out, "wb").write(body)
        report["pprof_bytes"] = len(body)

        if a.offcpu_pid:
            off_cpu(d, a, report)

        # Too large a window is refused with a message, shown on the page too.
        try:
            req = urllib.request.Request(a.url + "/api/view?minutes=120", headers=auth)
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError("minutes=120 was accepted")
        except urllib.error.HTTPError as e:
            msg = e.read().decode()
            assert e.code == 400 and "60" in msg, (e.code, msg)
            report["refusal"] = msg.strip()
        try:
            req = urllib.request.Request(a.url + "/api/view?mode=both", headers=auth)
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError("mode=both was accepted")
        except urllib.error.HTTPError as e:
            msg = e.read().decode()
            assert e.code == 400 and "wall" in msg, (e.code, msg)
        d.get(a.url + "/?again#minutes=120")  # a new document, not a hash change
        wait("the refusal on the page", lambda: d.find_element(By.ID, "error").is_displayed())
        report["page_refusal"] = d.find_element(By.ID, "error").text
        errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and "/api/view" not in e["message"]]
        assert not errors, f"console errors: {errors}"
    finally:
        d.quit()
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
