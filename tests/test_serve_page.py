"""The web page at ``/`` in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium): it loads, asks for the API key, chats with an
adapter streaming the same text as the API, and loads and unloads adapters. Skipped only
when Chromium is missing outside CI (CI=true: it must run there)."""

from __future__ import annotations

import os
import shutil

import pytest

from runtime import ByteTokenizer, Engine
from runtime.serve.app import ServeSettings

from test_serve import DEMO, KEY, MODEL, NEWLINE, TEMPLATE, Served, start_server, stop_server

IN_CI = os.environ.get("CI") == "true"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not IN_CI and not (CHROMIUM and DRIVER):
    pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver") if not IN_CI else __import__("selenium.webdriver").webdriver
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    adapters = tmp_path_factory.mktemp("page_adapters")
    for name in ("uppercase", "json"):
        shutil.copy(DEMO / "adapters" / f"{name}.tflite", adapters)
    engine = Engine(MODEL, tokenizer=ByteTokenizer(stop_token_ids=[NEWLINE]), chat_template=TEMPLATE)
    server, thread, url = start_server(engine, adapters, ServeSettings("demo", api_key=KEY))
    yield Served(url, engine, adapters)
    stop_server(server, thread)
    engine.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,860",
                     f"--user-data-dir={tmp_path_factory.mktemp('chromium_profile')}"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(browser, css: str, seconds: float = 20):
    return WebDriverWait(browser, seconds).until(lambda b: b.find_element(By.CSS_SELECTOR, css))


def text_of(browser, css: str) -> str:
    return browser.find_element(By.CSS_SELECTOR, css).get_property("textContent")


def test_the_page_asks_for_the_key_then_chats_with_an_adapter_as_the_api_streams(page_server, browser):
    browser.get(page_server.url + "/")
    key_field = wait_for(browser, "#api-key")
    WebDriverWait(browser, 10).until(lambda b: key_field.is_displayed())  # the server wants a key
    key_field.send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    wait_for(browser, "#use-uppercase").click()
    assert "context 256 tokens" in text_of(browser, "#model-info")
    browser.find_element(By.ID, "message").send_keys("my blue kite")
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, 'li.assistant[data-state="done"]'))
    shown = text_of(browser, "li.assistant .text")
    client = openai.OpenAI(base_url=f"{page_server.url}/v1", api_key=KEY, max_retries=0)
    stream = client.chat.completions.create(model="uppercase", messages=[{"role": "user", "content": "my blue kite"}],
                                            temperature=0, stream=True)
    expected = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert shown == expected and expected
    assert text_of(browser, "#ttft").endswith(" ms") and float(text_of(browser, "#tokens")) > 1
    # tokens/s is the server's decode pace (its timings), not the browser's arrival times,
    # which bunch up: it cannot exceed what the engine decodes at alone by much
    alone = max(client.completions.create(model="uppercase", prompt="my blue kite\n", temperature=0,
                                          max_tokens=12).timings["predicted_per_second"] for _ in range(3))
    assert 0 < float(text_of(browser, "#speed")) < 3 * alone
    WebDriverWait(browser, 10).until(lambda b: "KiB" in text_of(b, "#resident"))
    assert text_of(browser, "#resident").startswith("uppercase: ")


def test_the_page_unloads_and_loads_adapters_of_the_directory(page_server, browser):
    browser.get(page_server.url + "/")  # the key stays for the tab's session
    wait_for(browser, 'li[data-adapter="json"] button').click()
    wait_for(browser, 'li[data-file="json.tflite"] button').click()
    wait_for(browser, 'li[data-adapter="json"]')
    assert "json" in {card["id"] for card in page_server.call("/v1/models")[1]["data"]}
    assert not browser.find_elements(By.CSS_SELECTOR, 'li[data-file="json.tflite"]')
