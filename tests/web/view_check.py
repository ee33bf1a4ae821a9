"""Drives Debian's headless Chromium (selenium + chromedriver) against a running firn
enricher's web view and checks what a person would see. Run by tests/tests/view.rs.

Checks: the page loads without console errors; the flame graph names the workload's
functions; choosing a process narrows every part of the page to it; search highlights
frames; the download link serves a pprof (saved for `go tool pprof`); a window over the
hour is refused with a message. Screenshots go to --shots.
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


def wait(what, cond, timeout=30):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            v = cond()
            if v:
                return v
        except Exception:  # noqa: BLE001 (the page is redrawing)
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--token", required=True, help="the enricher's HTTP token")
    ap.add_argument("--pid", required=True)
    ap.add_argument("--function", required=True, help="a function of the workload, e.g. hot_leaf")
    ap.add_argument("--shots", required=True)
    ap.add_argument("--pprof-out", required=True)
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
        wait("one process", lambda: d.execute_script(
            "return Array.from(document.querySelectorAll('#processes tbody tr'), r => r.dataset.pid);") == [a.pid])
        comms = d.execute_script(
            "const v = window.__firnView(); return v.tree[2].map(n => v.names[n[0]]);")
        assert len(comms) == 1, f"flame graph roots after the filter: {comms}"
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

        # Too large a window is refused with a message, shown on the page too.
        try:
            req = urllib.request.Request(a.url + "/api/view?minutes=120", headers=auth)
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError("minutes=120 was accepted")
        except urllib.error.HTTPError as e:
            msg = e.read().decode()
            assert e.code == 400 and "60" in msg, (e.code, msg)
            report["refusal"] = msg.strip()
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
